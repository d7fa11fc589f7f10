"""The one C extension, the chained block hash's loops (`prfaas/common/_chain_hash.c`).
Everything else is in pyproject.toml. Building it needs a C compiler and the Python headers;
it is optional: where it does not build, the install goes on without it and
`prfaas/common/hashing.py` runs the same loops in Python (several times slower, logged)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "prfaas.common._chain_hash",
            sources=["prfaas/common/_chain_hash.c"],
            depends=["prfaas/common/vendor/xxhash.h"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
