"""``python -m metal_attn``: the ``metal-attn`` command."""

from metal_attn.cli import main

raise SystemExit(main())
