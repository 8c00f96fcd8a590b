"""Plumbing the core stands on, with no research idea in it: errors and exit statuses, atomic
writes and checksums, run folders, the launcher and process group, CPU threads, precision, the hub
probe."""
