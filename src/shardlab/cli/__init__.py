"""The `shardlab` command line: main.py lists the commands; each one's parser is in a *_flags.py module, the module it names runs it."""
