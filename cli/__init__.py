"""The `kvtier` commands: `serve`, `demo` and `bench` (cli.main builds the parser), and the
command-line flags they share (cli.flags)."""
