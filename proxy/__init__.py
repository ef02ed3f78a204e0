"""The proxy: key -> partition -> replica -> forward. Built in issue #5."""
