"""flatshare-ops: render, release and check Flatshare's GPU serving fleet."""
