"""The C extensions: the chained block hash's loops (`prfaas/common/_chain_hash.c`), the KV
event batches' scanner (`prfaas/protocol/kv_events/_scan.c`), and the KV index's hash
table's batch operations, its lookups' walk and a flush's per-key loops
(`prfaas/gateway/kv_index/`: `_buckets.c`, `_walk.c`, `_batch.c`). Everything else is in
pyproject.toml. Building them needs a C compiler and the Python headers; they are optional:
where one does not build, the install goes on without it and the same operations run in
Python and numpy (`hashing.py`, `table.py`, `walk.py`, `batch.py` beside them; several
times slower, logged), or msgspec reads every event batch."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "prfaas.common._chain_hash",
            sources=["prfaas/common/_chain_hash.c"],
            depends=[
                "prfaas/common/chain_hash.h",
                "prfaas/common/vendor/xxhash.h",
                "prfaas/common/msgpack_read.h",
            ],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "prfaas.protocol.kv_events._scan",
            sources=["prfaas/protocol/kv_events/_scan.c"],
            depends=["prfaas/common/msgpack_read.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "prfaas.gateway.kv_index._buckets",
            sources=["prfaas/gateway/kv_index/_buckets.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "prfaas.gateway.kv_index._batch",
            sources=["prfaas/gateway/kv_index/_batch.c"],
            depends=["prfaas/common/chain_hash.h", "prfaas/common/vendor/xxhash.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "prfaas.gateway.kv_index._walk",
            sources=["prfaas/gateway/kv_index/_walk.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
