"""Tiny-model tests run on one thread: their matmuls are too small for a second thread to pay, and on a shared
CPU an extra thread only spins (measured 10x slower). Real-model tests keep torch's default."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread(request):
    if request.node.get_closest_marker("real_model"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def host_cache_of_the_session(tmp_path_factory):
    """Host decisions the tests make (the verify's linear forms probed under `verify_linear="auto"`) go to a file of
    the session, never to the user's `~/.cache/jetspec/host.json`; a test may point `JETSPEC_HOST_CACHE` elsewhere."""
    import os

    previous = os.environ.get("JETSPEC_HOST_CACHE")
    os.environ["JETSPEC_HOST_CACHE"] = str(tmp_path_factory.mktemp("host") / "host.json")
    yield
    if previous is None:
        os.environ.pop("JETSPEC_HOST_CACHE", None)
    else:
        os.environ["JETSPEC_HOST_CACHE"] = previous


@pytest.fixture
def verifiers(monkeypatch):
    """The static verifiers the calls built, in order (tests of the static path)."""
    import modeling_jetspec.integration as integration

    built = []
    make = integration.static_verifier

    def recording(*args, **kwargs):
        built.append(make(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(integration, "static_verifier", recording)
    return built
