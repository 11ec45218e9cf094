"""The image the chart runs. Docker cannot build here (no daemon), so the Dockerfile is read instead:
pinned bases, a fixed non-root user, the `specsplit` entry point, every package folder copied in."""

import fnmatch
import re
import tomllib

from chart_render import REPO

PINNED_BASE = re.compile(r"^[a-z0-9./-]+:\d+\.\d+\.\d+[A-Za-z0-9_.-]*(@sha256:[a-f0-9]{64})?$")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
            for line in lines if line and not line.startswith("#")]


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def test_every_base_image_is_pinned_to_an_exact_version():
    bases = [args.split()[0] for op, args in instructions() if op == "FROM"]
    assert bases
    for base in bases:
        assert PINNED_BASE.match(base), f"FROM {base}: pin an exact version tag"
        assert "latest" not in base
    assert not [args for _, args in instructions() if ":latest" in args or "==latest" in args]


def test_runs_as_a_fixed_non_root_user():
    users = [args for op, args in final_stage() if op == "USER"]
    assert users == ["10001:10001"]  # numeric, so Kubernetes runAsNonRoot can check it
    setup = " ".join(args for op, args in final_stage() if op == "RUN")
    assert "--uid 10001" in setup and "--gid 10001" in setup


def test_every_pod_runs_as_the_images_user():
    """The pods' fixed uid is the image's (it owns /models there): the chart's pods and the operator's."""
    from chart_render import pod_templates, render
    from specsplit.operator.manifests import RUN_AS_USER

    (user,) = [args for op, args in final_stage() if op == "USER"]
    uid, gid = (int(part) for part in user.split(":"))
    assert RUN_AS_USER == uid == gid
    pods = pod_templates(render())
    assert len(pods) == 4  # the operator, the coordinator, target and draft
    for name, template in pods.items():
        context = template["spec"]["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (uid, gid, gid), name


def test_entry_point_cache_and_no_docker_healthcheck():
    stage = final_stage()
    assert ("ENTRYPOINT", '["specsplit"]') in stage
    assert ("HEALTHCHECK", "NONE") in stage  # Kubernetes probes the gRPC health service instead
    env = " ".join(args for op, args in stage if op == "ENV")
    assert "SPECSPLIT_CACHE=/models" in env


def test_torch_variant_is_a_build_argument():
    build_args = {args.split("=")[0] for op, args in instructions() if op == "ARG"}
    assert {"TORCH_VERSION", "TORCH_INDEX_URL"} <= build_args


def test_every_package_folder_is_copied_and_not_ignored():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = {args.split()[0].rstrip("/") for op, args in instructions() if op == "COPY" and "--from" not in args}
    assert folders <= copied, f"not copied into the image: {sorted(folders - copied)}"
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for source in copied | {"pyproject.toml"}:
        assert not any(fnmatch.fnmatch(source, pattern) for pattern in ignored), source
    assert {".git", "tests", "charts"} <= set(ignored)


def test_expose_lists_every_port_the_services_pods_declare():
    """EXPOSE is informational (Kubernetes ignores it), but it is where `docker run -P` and readers look."""
    from chart_render import operator_objects, render, speculative_deployment
    from chart_values import VALUE_SETS

    exposed = {int(port) for op, args in final_stage() if op == "EXPOSE" for port in args.split()}
    declared = {port["containerPort"]
                for values in (VALUE_SETS["defaults"], VALUE_SETS["colocated"])
                for obj in operator_objects(speculative_deployment(render(values))) if obj["kind"] == "Deployment"
                for container in obj["spec"]["template"]["spec"]["containers"] for port in container["ports"]}
    assert exposed == declared
