"""OCI images the test bed makes itself, with no registry and no Docker engine.

An OCI image is a layer tar, a config and a manifest, found through an index (the OCI image layout);
containerd imports such an archive with ``ctr images import``. Two images are built here from the
host's static busybox (Debian's ``busybox-static``): the pod sandbox's pause image (containerd's
``sandbox_image``; the public ``registry.k8s.io/pause`` is not reachable) and a small shell image
that tests use as a client inside the cluster. The project's own images (``images/*/Dockerfile``)
are built by ``scripts/images.sh``; this module only needs what every node needs before those.

Layers are written deterministically (sorted entries, mtime 0, uid 0), so the same inputs give the
same digests and an image is imported again only when what goes in changed.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

BUSYBOX = Path("/bin/busybox")
BED_REGISTRY = "mixrl.dev/"
"""Every image the bed imports is named under this prefix (no registry answers to it)."""
PAUSE_IMAGE = "mixrl.dev/pause:1"
SHELL_IMAGE = "mixrl.dev/busybox:1"
# What the pause container runs: it sleeps until told to stop (a pod sandbox only holds namespaces).
PAUSE_COMMAND = ["/bin/sh", "-c", 'trap "exit 0" TERM INT; while :; do sleep 3600 & wait $!; done']
# The applets linked into the shell image (busybox answers to its own name under each).
APPLETS = ("sh", "sleep", "cat", "echo", "ls", "nc", "nslookup", "env", "true", "false",
           "test", "grep", "timeout", "hostname", "id", "mkdir", "rm", "touch", "date", "httpd", "ping")  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One file, directory or symlink of a layer."""

    path: str
    data: bytes = b""
    mode: int = 0o644
    link: str | None = None
    directory: bool = False


@dataclass(frozen=True)
class ImageSpec:
    reference: str
    entries: tuple[Entry, ...]
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ("PATH=/bin",)
    user: str = ""
    labels: dict[str, str] = field(default_factory=dict)


def layer_tar(entries: tuple[Entry, ...]) -> bytes:
    """An uncompressed layer, byte for byte the same for the same entries."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(entries, key=lambda e: e.path):
            info = tarfile.TarInfo(entry.path.lstrip("/"))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if entry.directory:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif entry.link is not None:
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, entry.link, 0o777
                tar.addfile(info)
            else:
                info.size, info.mode = len(entry.data), entry.mode
                tar.addfile(info, io.BytesIO(entry.data))
    return buffer.getvalue()


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def oci_archive(spec: ImageSpec) -> bytes:
    """The image as an OCI layout in one tar: what ``ctr images import`` reads."""
    layer_digest, layer = _blob(layer_tar(spec.entries))
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": list(spec.env),
            **({"Entrypoint": list(spec.entrypoint)} if spec.entrypoint else {}),
            **({"Cmd": list(spec.cmd)} if spec.cmd else {}),
            **({"User": spec.user} if spec.user else {}),
            **({"Labels": dict(spec.labels)} if spec.labels else {}),
        },
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": "mixrl.devcluster.images"}],
    }
    config_digest, config_bytes = _blob(json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": len(config_bytes),
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": layer_digest,
                "size": len(layer),
            }
        ],
    }
    manifest_digest, manifest_bytes = _blob(json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "annotations": {
                    "io.containerd.image.name": spec.reference,
                    "org.opencontainers.image.ref.name": spec.reference.rsplit(":", 1)[-1],
                },
            }
        ],
    }
    files = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index, sort_keys=True).encode(),
    }
    for digest, data in (
        (layer_digest, layer),
        (config_digest, config_bytes),
        (manifest_digest, manifest_bytes),
    ):
        files["blobs/sha256/" + digest.removeprefix("sha256:")] = data
    return layer_tar(
        (
            Entry("blobs", directory=True),
            Entry("blobs/sha256", directory=True),
            *(Entry(path, data) for path, data in files.items()),
        )
    )


def busybox_entries(busybox: bytes) -> tuple[Entry, ...]:
    return (
        Entry("bin", directory=True),
        Entry("tmp", directory=True),
        Entry("bin/busybox", busybox, mode=0o755),
        *(Entry(f"bin/{applet}", link="busybox") for applet in APPLETS),
    )


def pause_image(busybox: bytes) -> ImageSpec:
    return ImageSpec(PAUSE_IMAGE, busybox_entries(busybox), entrypoint=tuple(PAUSE_COMMAND), user="65535")


def shell_image(busybox: bytes) -> ImageSpec:
    return ImageSpec(SHELL_IMAGE, busybox_entries(busybox), cmd=("sh",))


def node_images() -> list[ImageSpec]:
    """What every real node imports before it registers."""
    if not BUSYBOX.exists():
        raise FileNotFoundError(
            f"{BUSYBOX} is absent: install Debian's busybox-static (scripts/setup.sh does, as root)"
        )
    busybox = BUSYBOX.read_bytes()
    return [pause_image(busybox), shell_image(busybox)]
