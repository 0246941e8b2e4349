"""The `loragate` command line: starts engines and gateways."""
