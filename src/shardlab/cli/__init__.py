"""The `shardlab` command line: one module per sub-command, registered in main.py."""
