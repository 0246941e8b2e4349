"""The `loragate` command line, and what the engine and the gateway share (torch-free): errors, HTTP
plumbing, priorities, tracing setup and the hardened uvicorn server."""
