"""Builds the C core of the embedded local pool (shared-memory arena, index, LRU)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ascendstore.local._shmpool",
            sources=["ascendstore/local/_shmpool.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wno-unused-function"],
            libraries=["pthread", "rt"],
        )
    ]
)
