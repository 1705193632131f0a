"""`python -m hpcgnn` is the `hpcgnn` console command."""
from hpcgnn.cli import main

raise SystemExit(main())
