"""Small pieces shared by the gateway and the engines (block hashing, wire formats)."""
