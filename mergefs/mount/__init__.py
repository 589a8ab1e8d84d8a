"""The mount: the virtual model directory (FUSE-free), the FUSE adapter and the mount's lifecycle."""
