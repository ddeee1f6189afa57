"""autotune."""
