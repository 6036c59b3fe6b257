"""Transport plugins for kvlink, one module each; registered through the
``kvlink.transports`` entry-point group so importing this package loads no transport library."""
