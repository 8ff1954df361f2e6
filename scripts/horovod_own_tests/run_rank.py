"""One rank of the run: pytest on the prepared test_torch.py in $HOROVOD_OWN_TESTS_SRC (prepare.py), a
JUnit XML per rank in $HOROVOD_OWN_TESTS_OUT (default /tmp/horovod_own_tests/<impl>). Started by
run.sh under a launcher."""
import os
import sys

import pytest

here = os.environ["HOROVOD_OWN_TESTS_SRC"]
rank = os.environ.get("HOROVOD_RANK") or os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK", "0")
impl = os.environ.get("HVD_IMPL", "adacomp")
out = os.environ.get("HOROVOD_OWN_TESTS_OUT", f"/tmp/horovod_own_tests/{impl}")
os.makedirs(out, exist_ok=True)
args = ["-q", "-p", "no:cacheprovider", "-o", "addopts=", "--timeout", os.environ.get("TEST_TIMEOUT", "120"),
        "--rootdir", here, "--junitxml", os.path.join(out, f"rank{rank}.xml"), os.path.join(here, "test_torch.py")]
code = pytest.main(args + sys.argv[1:])
print(f"rank {rank}: pytest exit code {code}", flush=True)
sys.exit(0)  # failures are in the XML; a non-zero exit would make the launcher stop the other rank mid-test
