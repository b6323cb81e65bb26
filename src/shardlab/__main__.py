"""`python -m shardlab ...` (what torchrun runs: `torchrun ... -m shardlab COMMAND`)."""

import sys

from shardlab.cli.main import main

sys.exit(main())
