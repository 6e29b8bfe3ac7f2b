"""Container HEALTHCHECK: exit 0 when GET /health on the local server answers 200.

Standard library only (the slim image has no curl). The port comes from
FLASHSERVE_PORT, like the entry point's.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("FLASHSERVE_PORT", "8000")
    url = f"http://127.0.0.1:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:  # HTTPError (non-2xx) is a URLError
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
