"""What Horovod's test/parallel/test_torch.py imports from Horovod's test/utils/common.py, written for
this runner (not a copy): the rank and size an MPI launcher exports, the GPU skip, a temporary path."""
import contextlib
import os
import tempfile


def mpi_env_rank_and_size():
    """(rank, size) from an MPI launcher's environment; (0, 1) without one (as Horovod's helper)."""
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                               ("PMIX_RANK", "PMIX_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    """Skip a GPU test, or fail it when HOROVOD_TEST_GPU asks for GPUs."""
    if os.environ.get("HOROVOD_TEST_GPU"):
        test.fail(message)
    else:
        test.skipTest(message)


@contextlib.contextmanager
def temppath():
    """A path for a temporary file, removed afterwards."""
    fd, path = tempfile.mkstemp()
    os.close(fd)
    try:
        yield path
    finally:
        if os.path.exists(path):
            os.remove(path)
