"""Make the runnable copy of Horovod's ``test/parallel/test_torch.py`` in a work folder. The file is
Horovod's (Apache 2.0) and is not shipped with adacomp: point ``HOROVOD_TEST_TORCH`` at it in a
checkout of github.com/horovod/horovod. Edits, applied here and nowhere else:

1. ``import horovod.torch as hvd`` becomes ``import adacomp as hvd`` unless ``HVD_IMPL=horovod``
   (so the same copy also runs against real Horovod under horovodrun);
2. ``inspect.getargspec`` (gone in Python 3.11) is aliased to ``inspect.getfullargspec``.

Usage: python prepare.py UPSTREAM_TEST_TORCH_PY DEST_DIR (writes DEST_DIR/test_torch.py and the
helpers it imports, DEST_DIR/common.py)."""
import shutil
import sys
from pathlib import Path

IMPORT = "import horovod.torch as hvd\n"
REPLACEMENT = ("if os.environ.get('HVD_IMPL') == 'horovod':  # edit 1\n    import horovod.torch as hvd\nelse:\n"
               "    import adacomp as hvd\n\nif not hasattr(inspect, 'getargspec'):  # edit 2\n"
               "    inspect.getargspec = inspect.getfullargspec\n")


def main() -> int:
    src, dest = Path(sys.argv[1]), Path(sys.argv[2])
    text = src.read_text()
    if text.count(IMPORT) != 1 or "\nimport os\n" not in text or "\nimport inspect\n" not in text:
        raise SystemExit(f"{src}: not Horovod's test/parallel/test_torch.py as expected (one "
                         f"'{IMPORT.strip()}' line, 'import os' and 'import inspect')")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "test_torch.py").write_text(text.replace(IMPORT, REPLACEMENT))
    shutil.copy(Path(__file__).with_name("common.py"), dest / "common.py")
    print(f"prepared {dest / 'test_torch.py'} from {src}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
