"""flatshare-ops: render, release and check Flatshare's GPU serving fleet."""


def version() -> str:
    """This installation's flatshare-ops release (its distribution metadata), ``unknown`` where none is installed."""
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("flatshare-ops")
    except PackageNotFoundError:
        return "unknown"
