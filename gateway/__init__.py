"""loragate gateway: tenant auth, rate limits, admission and routing in front of engine replicas."""
