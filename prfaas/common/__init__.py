"""Small pieces shared by the gateway and the engines: block hashing, the tokenizer, KV-event
ZMQ publishing and subscribing, TOML tables."""
