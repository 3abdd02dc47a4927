"""The object-store mirror, by concept: client (settings, deadlines, errors), listing, manifest (one object
per top-level folder), lease, and mirror (the seam, with its uploads and the stale-upload sweep)."""

from mirrord.paths import S3Location
from mirrord.store.s3.client import S3Settings, make_client, node_name
from mirrord.store.s3.manifest import S3ManifestStore
from mirrord.store.s3.mirror import S3Mirror, S3UnitStaging, S3Upload, open_s3_mirror

__all__ = [
    "S3Location",
    "S3ManifestStore",
    "S3Mirror",
    "S3Settings",
    "S3UnitStaging",
    "S3Upload",
    "make_client",
    "node_name",
    "open_s3_mirror",
]
