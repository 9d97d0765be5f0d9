"""The controller's run records: where they live (`place`), the one writer (`record`),
reading them from another terminal (`reading`), and the end-of-run hook (`hook`)."""
