"""What the driver records for its operators in its directory: the error log and the loss
report.  Leaves: they import only the client library."""
