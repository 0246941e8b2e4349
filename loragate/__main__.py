"""`python -m loragate` runs the `loragate` command line."""

from __future__ import annotations

from loragate.cli import main

raise SystemExit(main())
