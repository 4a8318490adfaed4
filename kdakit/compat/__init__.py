"""Drop-in functions with the names, signatures and error texts of peer libraries."""
