"""The private Ray Serve attributes router/serve_internals.py relies on still exist on the
installed Ray (needs ray, no cluster). A failure names the Ray version and the attribute:
read the function that uses it, find what replaced it, and update that function."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from router.serve_internals import PRIVATE_APIS, PrivateApi  # noqa: E402


@pytest.mark.parametrize("api", PRIVATE_APIS, ids=[a.name for a in PRIVATE_APIS])
def test_private_serve_api_still_exists(api: PrivateApi) -> None:
    try:
        present = api.exists()
    except (AttributeError, ImportError, TypeError, OSError) as e:
        present = False
        detail = f" ({type(e).__name__}: {e})"
    else:
        detail = ""
    assert present, (
        f"Ray {ray.__version__}: the private Serve API {api.name} is gone or changed{detail}; "
        f"it is used by {api.used_by} (router/serve_internals.py, written against Ray 2.60)"
    )


class _RecordingHandle:
    def __init__(self) -> None:
        self.options_given: dict[str, object] = {}

    def options(self, **kwargs: object) -> _RecordingHandle:
        self.options_given = kwargs
        return self


@pytest.mark.parametrize("grpc_by_default", [True, False])
def test_process_transport_follows_serves_default_for_this_process(monkeypatch: pytest.MonkeyPatch,
                                                                   grpc_by_default: bool) -> None:
    from ray.serve._private import constants

    from router.serve_internals import process_transport

    monkeypatch.setattr(constants, "RAY_SERVE_USE_GRPC_BY_DEFAULT", grpc_by_default)
    given = process_transport(_RecordingHandle()).options_given
    if grpc_by_default:
        assert given == {"_by_reference": False, "request_serialization": "pickle",
                         "response_serialization": "pickle"}
    else:
        assert given == {"_by_reference": True}


def test_process_transport_keeps_the_actor_path_where_object_refs_travel(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.serve._private import constants

    from router.serve_internals import process_transport

    monkeypatch.setattr(constants, "RAY_SERVE_USE_GRPC_BY_DEFAULT", True)
    assert process_transport(_RecordingHandle(), by_reference=True).options_given == {"_by_reference": True}
