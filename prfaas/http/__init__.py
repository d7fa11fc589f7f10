"""The HTTP/1.1 server the gateway serves on and the lean client of its engine calls, both
over llhttp (`httptools`)."""
