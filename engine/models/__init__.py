"""Model families behind one interface (family.py): each file here that defines `FAMILY` is a
family the loaders and the runner find through registry.py."""
