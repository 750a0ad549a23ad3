"""Memory, measured (``meters``) and estimated before launch (``estimate``)."""
