//! The canonical `.graph` text form: printer and parser.
