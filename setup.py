"""The one C extension, the chained block hash's loop (`prfaas/common/_chain_hash.c`;
`prfaas/common/hashing.py` runs the same loop in Python where it is not built). Everything
else is in pyproject.toml. Building needs a C compiler and the Python headers."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "prfaas.common._chain_hash",
            sources=["prfaas/common/_chain_hash.c"],
            depends=["prfaas/common/vendor/xxhash.h"],
            extra_compile_args=["-O3"],
        )
    ]
)
