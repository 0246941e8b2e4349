"""The `loragate` command line, at the top of the import graph: it imports the engine, the gateway and
loragate_common, and nothing below imports it."""
