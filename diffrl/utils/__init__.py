"""Small helpers with no better home (images on disk, devices)."""
