"""SciWorld: the ScienceWorld simulator (a JVM behind py4j) as an async text env with scripted policies."""
