"""The `vsurge` command: `main` (its parser and subcommands), `serve_options` (every `serve` option, its
`VSURGE_*` variable and ServeConfig), `print_config` (`vsurge serve --print-config`) and `sizing` (slots
and context from the device's memory). `python -m vsurge.cli` runs the command.
"""
