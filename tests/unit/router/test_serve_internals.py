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
