"""The stores: paths beneath a root, durable publishing, volumes and mirrors, the manifest, scans, identity, repair."""
