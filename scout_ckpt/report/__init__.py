"""The fault timeline: the ledger folded into events (`timeline`), drawn as a picture and an HTML page (`page`)."""
