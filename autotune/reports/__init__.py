"""Pictures and reports: data in, PNG / HTML / tables out."""
