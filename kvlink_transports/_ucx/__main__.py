"""``python -m kvlink_transports._ucx``: what UCX offers and picks here, and what NIXL measured,
as JSON (the command line of the face's :func:`~kvlink_transports._ucx.info.report`)."""

import json

from kvlink_transports._ucx import nixl_protocols, report

if __name__ == "__main__":
    rep = report()
    rep["nixl_measured"] = nixl_protocols()
    print(json.dumps(rep, indent=2))
