"""A running service's Prometheus page, read the way Prometheus reads it (the tests' one reader)."""


def scrape(url: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} from the Prometheus text page at `url`/metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }
