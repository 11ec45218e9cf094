"""A batched worker call whose items were checked one by one while decoding: the invalid ones stay their
InvalidArgument in place, the rest run as one batch. One bad item (from a buggy or hostile caller) never fails the
other sequences batched with it."""


def valid_items_only(step):
    def run(items: list) -> list:
        valid = [i for i in items if not isinstance(i, Exception)]
        if len(valid) == len(items):
            return step(items)
        results = iter(step(valid) if valid else ())
        return [i if isinstance(i, Exception) else next(results) for i in items]

    return run
