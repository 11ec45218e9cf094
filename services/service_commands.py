"""`specsplit target|draft|coordinator|serve`: filled in by the gRPC services."""


def add_service_commands(sub, add_model_args) -> None:
    return None
