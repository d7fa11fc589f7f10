"""Several gateways over one set of engines: a leader elected on etcd runs the schedulers and
publishes their decisions; every replica routes, and shares what its request path saw."""
