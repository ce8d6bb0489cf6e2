"""URI and name patterns of the RLJob API: only what the runtime can read is accepted."""

from __future__ import annotations

ENTRYPOINT_PATTERN = (
    r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
)
# Only what the runtime can read: pvc:// (a mounted claim), file://, s3:// (storage.py) and
# builtin://. gs:// is left out until it can be tested against a server like s3:// is.
_S3_URI = r"s3://[a-z0-9][-a-z0-9.]{1,61}[a-z0-9](/.*)?"
CHECKPOINT_URI_PATTERN = rf"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|file:///.*|{_S3_URI})$"
MODEL_URI_PATTERN = (
    rf"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|file:///.*|{_S3_URI}|builtin://[a-z0-9][-a-z0-9]*)$"
)
# Where transport storage writes versions: a store or file system that trainers and engines share.
WEIGHT_SYNC_URI_PATTERN = rf"^(file:///.*|{_S3_URI})$"
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
GPU_TYPE_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
