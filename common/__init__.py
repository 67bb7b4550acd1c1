"""What server and client both read: the method table, wire constants, options, parameter roles."""
