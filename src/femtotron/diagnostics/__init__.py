"""Tools that find out why a run misbehaves: each compares or inspects, and names what is wrong."""
