"""The engine's step loop and the state it owns: requests, scheduling, the page pool."""
