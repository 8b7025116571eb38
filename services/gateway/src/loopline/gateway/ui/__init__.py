"""The dashboard at ``/ui``: server-rendered pages of the cluster, jobs and Tinker runs, kept live
over one event stream per page."""
